"""Full model weights through the bucket: versioned anchors and sparse deltas, pulled by
every vLLM replica (`finetuning: full`). See docs/weights.md."""
