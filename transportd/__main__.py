from transportd.entry import main

main()
