from autopar.cli import main

raise SystemExit(main())
