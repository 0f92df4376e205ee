"""Text and corpora: the shared BPE vocabulary (§5.1), aligned corpus files, paragraphs, HTML and sentences."""
