"""Stage 1 of the job: input files -> raw documents (and read rejects).

A `*_transform` module holds the stage's Beam steps; the others are pure functions and formats.

- `inputs_transform`: the Beam step (`ReadInputs`): patterns -> files (or byte ranges) ->
  documents;
- `input_files`: opening one file: decompression, file-level rejects (empty, binary, truncated);
- `readers`: one reader per input format (jsonl, parquet, wiki, wikiextractor, books, sentences);
- `wiki_xml`: MediaWiki XML dumps -> articles, streamed, with byte-range plans for multistream;
- `wikitext`: MediaWiki markup -> plain-text paragraphs;
- `records`: what a reader yields, `RawDocument` or `Reject`.
"""
