"""The market: what hardware there is and what it costs.

Owns the hardware profiles and their offers (hardware), instance facts from the catalogs
(instances), price lists and their import (prices), what a price is worth (pricebook: age,
outliers, spot interruption rates), spot risk in hours (spotrisk) and the offers a spec allows
with their price facts (offers: `OfferChoice.node_price`).

May import: gptplan and planner.spec only.
"""
