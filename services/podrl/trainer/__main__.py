from podrl.trainer.main import main

raise SystemExit(main())
