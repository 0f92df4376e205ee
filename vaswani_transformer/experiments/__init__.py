"""Experiments over many training runs: the paper's Table 3 ablation (`ablation`), its rows and its report."""
