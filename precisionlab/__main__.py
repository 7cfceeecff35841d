from precisionlab.cli import main

raise SystemExit(main())
