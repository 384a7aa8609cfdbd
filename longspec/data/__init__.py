"""What a stage trains on: records in, tokens and labels out.

    records.py     a train_file's records (JSON/JSONL streamed, parquet/arrow rows), its last ones alone
    chat.py        what a chat record trains: `split_chat` (prompt / answer / end of turn), by rendering
    collators.py   one encoder per stage: a record's fields -> (text, kind) pieces
    encoding.py    the one tokens+labels rule (`assemble`), datasets, the sampler, loaders
    cache.py       the prepared cache: tokenize once, under a lock, serve as a memmap Dataset
    preview.py     the first records token by token (`prepare --show`) and the first-records check
    synthetic.py   the tiny preset's synthetic language, stage records and pre-training corpus
    tinybuild.py   the tiny preset built: tokenizer, pre-trained target (cached), stage data (`python -m longspec.tiny`)
    regen.py       regeneration's rows: prompt rules (chat turns, document prefixes), the trained record
    regenstore.py  regeneration's folder: ordered parquet shards (atomic), manifest, resume, refusals

Imports no other group of the trainer. (A docstring only: nothing loads through the package.)
"""
