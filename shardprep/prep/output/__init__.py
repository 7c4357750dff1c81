"""The output side of the offline tools: what writes an output directory, and what opens one to read it back.

- `output_dir.py`: the directory itself: checked, locked, staged beside OUT and swapped into place atomically;
- `writer.py`: convert's plan carried out (rank files, replicated part, manifest), the pieces reshard and export
  write with (rank files and chunks, the manifest, `link_or_copy` and its `CopyMode`), and the disk-space bounds;
- `safetensors_writer.py`: one safetensors file from tensors in memory or byte ranges of other files;
- `file_ranges.py`: bytes into files (copy_file_range, splice, pwrite);
- `writeback.py`: early disk writes and the final fsyncs;
- `opened_output.py`: an output directory opened and checked to be read back whole (reshard's and export's
  input), and `read_layer`, one layer's bytes from its N chunks;
- `carried_files.py`: files of an opened output hard-linked (or copied) into a new one and checked where they land.
"""
