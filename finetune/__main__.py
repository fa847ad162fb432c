"""`python -m finetune ...` and `accelerate launch ... -m finetune ...`."""

import os
import sys

# Before torch starts CUDA: let the caching allocator grow its segments in place unless the user set
# it up otherwise. Evaluation's beam caches grow by one position every step; without this the first
# evaluation of 1,000 rows spent ~1.2 s of ~6 in new allocations on an H200, and training speed is
# the same either way (docs/benchmarks.md).
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

from finetune.cli import main  # noqa: E402  (after the allocator setting, on purpose)

sys.exit(main())
