from transportd.daemon.entry import main

main()
