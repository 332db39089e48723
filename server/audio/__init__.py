"""Speech to text: audio uploads decoded (decode.py), their log-mel windows (features.py) and the
decoder prompts and decoding defaults of a Whisper model (speech_model.py)."""
