"""Where samples come from: the ``Source`` interface and the epoch order (``source``), the shard reader (``shards``) and JPEG decode (``decode``)."""
