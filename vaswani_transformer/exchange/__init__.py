"""What is saved and exchanged: a translator's directory (`saving`), its model card (`model_card`), the Hub (`hub`),
Marian (`marian`) and CTranslate2 (`ctranslate2`)."""
