"""`vaswani-transformer serve`: the LibreTranslate API over HTTP (FastAPI), micro-batched."""
