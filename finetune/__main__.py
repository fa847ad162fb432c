"""`python -m finetune ...` and `accelerate launch ... -m finetune ...`."""

import sys

from finetune.train import main

sys.exit(main())
