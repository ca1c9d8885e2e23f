from cute_mxfp8.cli.main import main; main()
