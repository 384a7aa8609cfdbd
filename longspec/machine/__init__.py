"""The machine a stage runs on: GPUs, CUDA architectures, processes, DeepSpeed's op folder, memory estimates
(torch-free arithmetic and probes: the front end imports this group, the trainer sizes by it).

    gpus.py         the GPUs this process may use (nvidia-smi, CUDA_VISIBLE_DEVICES), total/free memory
    cudaarch.py     TORCH_CUDA_ARCH_LIST in a form DeepSpeed's op builders parse
    liveness.py     is a process alive (pid + start time); a group's members; who holds a file open
    opsdir.py       the folder DeepSpeed's JIT ops build into; locks stopped builds left there
    memory.py       a stage's per-GPU memory estimate; the reference attention's chunk sizing rule
    evalmemory.py   eval's length buckets and whether the longest fits its device
    vllmenv.py      the vLLM environment `serve` and `doctor` use: its Python, its vLLM and plugin

(A docstring only: nothing loads through the package.)
"""
