"""`python -m finetune ...` and `accelerate launch ... -m finetune ...`."""

import sys

from finetune.cli import main

sys.exit(main())
