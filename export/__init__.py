"""Export: a trained checkpoint to one self-describing ONNX file, and the runtime that runs it."""
