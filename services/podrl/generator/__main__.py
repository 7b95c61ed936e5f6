from podrl.generator.main import main

raise SystemExit(main())
