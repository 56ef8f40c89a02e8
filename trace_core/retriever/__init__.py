"""The retrieval service the multi-hop envs search over HTTP (Search-R1's API).

    trace-rl retriever build --corpus corpus.parquet --model minilm --output build/index
    trace-rl retriever serve --index build/index --port 8000

``corpus`` reads passages (Parquet ``id, title, text`` or Search-R1's JSONL ``id, contents``),
``encoder`` embeds them with a sentence-embedding model, ``index`` builds and loads a dense
(faiss) or BM25 (bm25s) index with the model and corpus it was built from, and ``server`` serves
it with FastAPI, batching the queries of concurrent requests through the encoder. The envs'
client is ``trace_core.envs.remote``.
"""
