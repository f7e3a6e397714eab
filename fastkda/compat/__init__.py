"""Drop-in signatures of the peers: :mod:`fastkda.compat.flash_kda` (FlashKDA) and :mod:`fastkda.compat.fla` (FLA)."""
