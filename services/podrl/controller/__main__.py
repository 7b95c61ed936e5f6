from podrl.controller.service.main import main

raise SystemExit(main())
