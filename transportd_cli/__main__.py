from transportd_cli.cli import main

main()
