"""Training an Eagle3 draft head for a target model (`python -m dynamo.vllm.train_eagle3`)."""
