from podrl.controller.main import main

raise SystemExit(main())
