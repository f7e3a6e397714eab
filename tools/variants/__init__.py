"""Variants of the prefill kernels: plan changes or whole other copies of ``fastkda/ops/prefill/``, timed on the
GPU against each other (``prepare_variants.py``) or measured against float64 on the CPU (``variant_accuracy.py``)."""
