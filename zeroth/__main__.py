import sys

from zeroth.cli import main

sys.exit(main())
