"""What a model is: ModelConfig, Hugging Face config parsing, the presets, and the step map from (model, phase, engine settings) to the ordered operator slots of one step."""
