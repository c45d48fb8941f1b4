"""The tiny trained target/drafter pair: corpus, tokenizer, models and the trainer."""
