from mlx_lm.generate import stream_generate as stream_generate
