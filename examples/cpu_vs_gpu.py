"""Is my GPU actually being used, and how much faster than my CPU is it?

`devicekit bench` answers with numbers: matmul rates on the CPU and each GPU,
copy bandwidth, and what a kernel launch and a synchronize cost. Without a GPU
it measures the CPU only and says so.
"""

import devicekit as dk

print(dk.bench())
