"""Data formats both sides read: what a train_file names, the prepared cache's key and manifest,
the trained-token view (torch-free: the front end imports this group; the writers are in data/).

    datafiles.py     a train_file: JSON text, parquet files, folders or globs of shards,
                     save_to_disk folders; the columns each collator reads; rows streamed
    prepared.py      the prepared cache's key, folder, manifest checks and refusals (data/cache.py
                     writes it)
    trainedview.py   `prepare --show`'s layout: trained spans in [brackets], or colour on a terminal
    vllmdraft.py     the vLLM draft folder (`export --format vllm`), the vLLM versions the serving
                     plugin supports, the engine flags a GLIDE draft needs

(A docstring only: nothing loads through the package.)
"""
