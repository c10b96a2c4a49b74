"""The data pipeline: ingest and tokenize sources into token shards with a manifest (prepare),
the embedded default corpus, and the canonical, topology-invariant window stream."""
