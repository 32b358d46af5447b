"""The OpenAI surface: request structs, error envelopes and the headers contract."""
