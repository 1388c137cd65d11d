import sys

from pagedkv_lab.exercises.cli import main

sys.exit(main())
