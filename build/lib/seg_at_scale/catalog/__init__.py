"""STAC metadata: an Item beside each output, ItemCollections, and STAC catalogs as inputs."""

from seg_at_scale.catalog.inputs import image_hrefs
from seg_at_scale.catalog.items import (
    item_collection,
    item_path,
    stac_item,
    write_item,
    write_item_collection,
)

__all__ = ["image_hrefs", "item_collection", "item_path", "stac_item", "write_item",
           "write_item_collection"]
