"""Conversations -> chat-templated token ids, loss masks and captured target hidden states."""
