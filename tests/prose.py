"""What the course's prose may not hold, shared by the notebook and claim tests."""

import re

# A figure with a unit in prose: the course renders those from the run or labkit.budget, never types them.
# A number with a unit (rates too), or a measured-looking ratio ("1.48x"); a formula's "3 x" is not one.
TYPED_FIGURE = re.compile(
    r"\b\d[\d,.]*\s?(GB/s|MB/s|TFLOP/s|GFLOP/s|params/s|GB|MB|kB|GiB|MiB|TB|ms|s|%)(?![\w/])|\b\d+\.\d+x\b"
)
