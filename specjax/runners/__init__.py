"""Host drivers: one skeleton (check -> bucket -> pad -> prefill -> device loop -> outputs) for plain,
speculative, Neuron and batch generation."""
