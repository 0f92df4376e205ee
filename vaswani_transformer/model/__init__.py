"""The model of §3 and its decoding (§6.1): the files saved with every model for `trust_remote_code`.

They import only each other, torch and transformers, through public APIs (import-linter holds them to it:
`pyproject.toml`), so that a saved model runs without this package.
"""
