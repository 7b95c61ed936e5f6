from podrl.cli.main import main

raise SystemExit(main())
