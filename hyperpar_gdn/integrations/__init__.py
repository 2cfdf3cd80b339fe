"""Integrations with other libraries; the core (ops, distributed, models) names none of them."""
