"""The hybrid MoE policy model of the Kimi K3 family: KDA + gated MLA + MoE with Quantile Balancing + Block AttnRes."""
