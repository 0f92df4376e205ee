"""Translation with a trained model: the decoding options (`config`), the engines (`engines`: PyTorch, CTranslate2),
batches and BLEU (`translation`), a file or stdin (`input_translation`), a test set scored (`evaluation`)."""
