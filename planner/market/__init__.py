"""The market: what hardware there is and what it costs.

Owns the hardware profiles and their offers (hardware), instance facts from the catalogs
(instances), price lists and their import (prices), what a price is worth (pricebook: age,
outliers, spot interruption rates), spot risk in hours (spotrisk), the offers a spec allows
with their price facts (offers: `OfferChoice.node_price`), the launcher's facts (skyfacts: the
task's disk size, which SkyPilot attaches EFA) and the task's disk in the cost (disks).

May import: gptplan and planner.spec only.
"""
