package ociimage

import (
	"archive/tar"
	"bytes"
	"io"
	"os"
	"testing"
	"time"
)

// TestLayerTar: files, links and directories (a sticky one) with their
// parents; bad paths, a path given twice and a link used as a
// directory are refused.
func TestLayerTar(t *testing.T) {
	files := []File{
		{Path: "usr/bin/curl", Mode: 0o755, Data: []byte("curl")},
		{Path: "bin", Mode: os.ModeSymlink | 0o777, Link: "usr/bin"},
		{Path: "tmp", Mode: os.ModeDir | os.ModeSticky | 0o777},
	}
	data, err := LayerTar(files, time.Unix(0, 0))
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]*tar.Header{}
	tr := tar.NewReader(bytes.NewReader(data))
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		got[h.Name] = h
	}
	if h := got["bin"]; h == nil || h.Typeflag != tar.TypeSymlink || h.Linkname != "usr/bin" {
		t.Errorf("bin: %+v", h)
	}
	if h := got["tmp/"]; h == nil || h.Mode != 0o1777 {
		t.Errorf("tmp/: %+v", h)
	}
	if got["usr/"] == nil || got["usr/bin/"] == nil || got["usr/bin/curl"] == nil {
		t.Errorf("missing entries: %v", got)
	}
	for _, bad := range [][]File{
		{{Path: "/abs", Mode: 0o644}},
		{{Path: "a/../b", Mode: 0o644}},
		{{Path: "x", Mode: 0o644}, {Path: "x", Mode: 0o644}},
		{{Path: "l", Mode: os.ModeSymlink, Link: "y"}, {Path: "l/f", Mode: 0o644}},
		{{Path: "f", Mode: 0o644}, {Path: "f/g", Mode: 0o644}},
	} {
		if _, err := LayerTar(bad, time.Unix(0, 0)); err == nil {
			t.Errorf("LayerTar(%v): no error", bad)
		}
	}
}
