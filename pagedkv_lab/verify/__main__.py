import sys

from pagedkv_lab.verify.cli import main

sys.exit(main())
