"""Tool calls: which syntax a model family writes them in (`formats`), the
streaming parser that reads them out of generated text (`parser`), and the
prompt exo uses for models whose template has no tool support (`fallback`)."""
