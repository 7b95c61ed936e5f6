from podrl.grader.main import main

raise SystemExit(main())
