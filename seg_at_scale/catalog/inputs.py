"""STAC as input: the images an ItemCollection, a Catalog or a Collection lists (local files).

>>> image_hrefs("archive/items.json")  # doctest: +SKIP
[('S2A_T33UUP_20240601', '/data/archive/S2A_T33UUP_20240601/B04.tif'), ...]

An Item's image is the asset named by ``asset`` when given, else the first asset with role
``data`` and a TIFF media type, else the first TIFF asset, else the first ``data`` asset.
Relative hrefs are resolved against the folder of the JSON file that holds them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pystac

from seg_at_scale.config_check import check_local
from seg_at_scale.errors import InputError

__all__ = ["image_hrefs", "image_asset", "MAX_DEPTH", "MAX_LINKED"]

#: The walk of a Catalog stops here: catalogues nested deeper, or more catalogues and
#: Items linked in all, are refused (a runaway catalogue, not an archive).
MAX_DEPTH = 64
MAX_LINKED = 1_000_000


def image_hrefs(path_or_json: str | os.PathLike[str] | Mapping[str, Any], *,
                asset: str | None = None) -> list[tuple[str, str]]:
    """``(item id, local image path)`` of every Item, in the order they are listed.

    Args:
        path_or_json: a STAC JSON file (ItemCollection, Catalog, Collection or one Item),
            or its parsed dict (relative hrefs then resolve against the working folder).
        asset: the asset key to take from every Item (default: see the module docstring).

    Raises:
        InputError: not STAC JSON, an Item without a suitable asset (naming the item and
            its asset keys), a remote href, or two Items with one id (their outputs would
            share a name).
    """
    items, where = _items(path_or_json)
    found: list[tuple[str, str]] = []
    seen: set[str] = set()
    for item, base in items:
        if item.id in seen:
            raise InputError(f"{where}: two items have the id '{item.id}'; their outputs would "
                             "share one name: give the items distinct ids")
        seen.add(item.id)
        found.append((item.id, _local(image_asset(item, asset).href, base, item.id)))
    return found


def image_asset(item: pystac.Item, key: str | None = None) -> pystac.Asset:
    """The asset holding the image of ``item`` (see the module docstring).

    Raises:
        InputError: ``key`` is not an asset of the item, or no asset looks like an image.
    """
    keys = ", ".join(item.assets) or "none"
    if key is not None:
        if key not in item.assets:
            raise InputError(f"item '{item.id}' has no asset '{key}' (its assets: {keys}); "
                             "pass one of them as asset=")
        return item.assets[key]
    assets = list(item.assets.values())
    tiff = [a for a in assets if (a.media_type or "").startswith("image/tiff")]
    data = [a for a in assets if "data" in (a.roles or [])]
    for choice in ([a for a in data if a in tiff], tiff, data):
        if choice:
            return choice[0]
    raise InputError(f"item '{item.id}' has no image asset (no role 'data', no image/tiff "
                     f"media type; its assets: {keys}); in the STAC JSON, give its image "
                     "asset the role 'data' or the type 'image/tiff; application=geotiff'")


def _items(source: str | os.PathLike[str] | Mapping[str, Any]
           ) -> tuple[Iterable[tuple[pystac.Item, Path]], str]:
    """The Items of a STAC document, each with the folder its relative hrefs start from."""
    if isinstance(source, Mapping):
        doc, path = dict(source), None
    else:
        path = Path(source).resolve()
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise InputError(f"cannot read '{source}' as STAC JSON: {exc}") from exc
    where = str(source) if path else "the STAC document"
    base = path.parent if path else Path.cwd()
    kind = doc.get("type") if isinstance(doc, dict) else None
    try:
        if kind == "FeatureCollection":
            collection = pystac.ItemCollection.from_dict(doc, preserve_dict=False)
            return ((item, base) for item in collection), where
        if kind == "Feature":
            return [(pystac.Item.from_dict(doc), base)], where
        if kind in ("Catalog", "Collection"):
            catalog = pystac.read_file(str(path)) if path else pystac.read_dict(doc)
            assert isinstance(catalog, pystac.Catalog)
            # every linked Item read now (a broken link refused before any work), by a walk
            # of our own: pystac's recursed without end on a catalogue whose links loop
            return [(item, _folder(item, base)) for item in _walk(catalog, base, where)
                    ], where
    except InputError:
        raise
    except (pystac.STACError, OSError, KeyError, TypeError, ValueError) as exc:
        raise InputError(f"{where} is not a valid STAC {kind}: {exc}; fix the file or the "
                         "link it names") from exc
    raise InputError(f"{where} has type {kind!r}; expected a STAC ItemCollection "
                     "(FeatureCollection), Catalog, Collection or Item")


def _walk(root: pystac.Catalog, base: Path, where: str) -> list[pystac.Item]:
    """Every Item below ``root`` (its own first, then each child's, in link order).

    Each catalogue is read once (one reached again by another path is not walked twice);
    one that links back to a catalogue above it is refused, naming the loop, and the walk
    is bounded by :data:`MAX_DEPTH` and :data:`MAX_LINKED`.

    Raises:
        InputError: a loop, a bound passed, or a link to something of the wrong type.
    """
    top = _key(root.get_self_href(), base)
    seen = {top}
    found: list[pystac.Item] = []
    count = 1

    def visit(catalog: pystac.Catalog, chain: tuple[str, ...]) -> None:
        nonlocal count
        children = []
        for link in catalog.links:
            if link.rel not in ("item", "child"):
                continue
            count += 1
            if count > MAX_LINKED:
                raise InputError(f"{where} links more than {MAX_LINKED} catalogues and items "
                                 f"(MAX_LINKED, the bound of the walk); split it into "
                                 "several catalogues and predict each")
            href = _key(link.get_absolute_href() or link.href, base)
            if link.rel == "item":
                found.append(_read(href, pystac.Item, where, "item"))
            elif href in chain:
                loop = " -> ".join(_shown(h, top) for h in (*chain[chain.index(href):], href))
                raise InputError(f"{where}: its catalogue links loop ({loop}); remove the "
                                 f"'child' link of '{_shown(chain[-1], top)}' that points "
                                 "back")
            elif href not in seen:
                seen.add(href)
                children.append(href)
        for href in children:
            if len(chain) >= MAX_DEPTH:
                raise InputError(f"{where}: catalogues nest more than {MAX_DEPTH} deep "
                                 f"(MAX_DEPTH, the bound of the walk) at '{_shown(href, top)}'"
                                 "; flatten the catalogue")
            visit(_read(href, pystac.Catalog, where, "child"), (*chain, href))

    visit(root, (top,))
    return found


def _read(href: str, kind: type[Any], where: str, rel: str) -> Any:
    """The STAC object at ``href``, refused unless it is a ``kind``."""
    obj = pystac.read_file(href)
    if not isinstance(obj, kind):
        raise InputError(f"{where}: the '{rel}' link '{href}' is a STAC "
                         f"{type(obj).__name__}, not a{'n' if rel == 'item' else ''} "
                         f"{kind.__name__}; fix the link")
    return obj


def _key(href: str | None, base: Path) -> str:
    """A catalogue's identity: its resolved local path (links and ``..`` resolved)."""
    if not href:
        return "<the STAC document>"
    scheme = urlparse(href).scheme
    if scheme == "file":
        href = urlparse(href).path
    elif scheme and len(scheme) > 1:
        return href
    return os.path.realpath(href if Path(href).is_absolute() else base / href)


def _shown(href: str, top: str) -> str:
    """``href`` relative to the top catalogue's folder when it lies below it."""
    folder = os.path.dirname(top)
    if os.path.isabs(href) and os.path.isabs(top):
        rel = os.path.relpath(href, folder)
        return rel if not rel.startswith("..") else href
    return href


def _folder(item: pystac.Item, default: Path) -> Path:
    """The folder of an Item's own JSON file (its relative hrefs start there)."""
    href = item.get_self_href()
    return Path(href).parent if href and not urlparse(href).scheme else default


def _local(href: str, base: Path, item_id: str) -> str:
    """``href`` as a local path, resolved against ``base`` when relative."""
    check_local(f"item '{item_id}': the image '{href}'", href, error=InputError)
    if urlparse(href).scheme == "file":
        href = urlparse(href).path
    return str(Path(href) if Path(href).is_absolute() else (base / href).resolve())
