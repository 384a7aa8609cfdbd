from longspec_cli.app import main

main()
