import sys

from chatapp.cli import main

sys.exit(main())
