package conformance

import (
	"archive/tar"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// A trimmed ginkgo JSON report: a suite node, a passed, a failed, a
// runtime-skipped and a not-selected spec.
const report = `[{"SuiteDescription":"Kubernetes e2e suite","PreRunStats":{"TotalSpecs":6,"SpecsThatWillRun":4},"SpecReports":[
 {"LeafNodeType":"SynchronizedBeforeSuite","State":"passed","StartTime":"2026-12-01T16:00:00Z"},
 {"ContainerHierarchyTexts":["[sig-network] Networking","Granular Checks: Pods"],"LeafNodeType":"It","LeafNodeText":"should function for intra-pod communication: http","State":"passed","StartTime":"2026-12-01T16:00:01Z","NumAttempts":1,"RunTime":21000000000},
 {"ContainerHierarchyTexts":["[sig-network] Services"],"LeafNodeType":"It","LeafNodeText":"should serve a basic endpoint from pods","State":"failed","StartTime":"2026-12-01T16:00:30Z","NumAttempts":1,"RunTime":5000000000,"Failure":{"Message":"timed out\nwaiting"}},
 {"ContainerHierarchyTexts":["[sig-network] Services"],"LeafNodeType":"It","LeafNodeText":"should work after restarting apiserver","State":"skipped","StartTime":"2026-12-01T16:01:00Z","NumAttempts":1,"Failure":{"Message":"Only supported for providers [gce gke] (not skeleton)"}},
 {"ContainerHierarchyTexts":["[sig-storage] CSI"],"LeafNodeType":"It","LeafNodeText":"something else","State":"skipped","StartTime":"2026-12-01T16:00:00Z","NumAttempts":0},
 {"ContainerHierarchyTexts":["[sig-network] Services"],"LeafNodeType":"It","LeafNodeText":"never reached","State":"skipped","StartTime":"2026-12-01T16:00:00Z","NumAttempts":0},
 {"LeafNodeType":"ReportAfterSuite","State":"passed","StartTime":"2026-12-01T16:02:00Z"}
]}]`

func TestSummarize(t *testing.T) {
	r, err := Summarize([]byte(report))
	if err != nil {
		t.Fatal(err)
	}
	if len(r.Passed) != 1 || len(r.Failed) != 1 || len(r.Skipped) != 1 || r.NotReached != 1 || r.NotSelected != 1 {
		t.Fatalf("counts: %d passed, %d failed, %d skipped, %d not reached, %d not selected; want 1 each", len(r.Passed), len(r.Failed), len(r.Skipped), r.NotReached, r.NotSelected)
	}
	if want := "[sig-network] Services should serve a basic endpoint from pods"; r.Failed[0].Name != want {
		t.Errorf("failed spec %q, want %q", r.Failed[0].Name, want)
	}
	table := r.Table()
	for _, want := range []string{"1 passed, 1 failed, 1 skipped at run time, 1 selected but not reached (1 specs not selected", "FAIL", "timed out waiting", "not skeleton"} {
		if !strings.Contains(table, want) {
			t.Errorf("table lacks %q:\n%s", want, table)
		}
	}
}

func TestSummarizeRejectsBadReports(t *testing.T) {
	for _, in := range []string{"", "{", "[]", `{"SpecReports":[]}`} {
		if _, err := Summarize([]byte(in)); err == nil {
			t.Errorf("Summarize(%q): no error", in)
		}
	}
}

func TestImagesFor(t *testing.T) {
	list := "registry.k8s.io/e2e-test-images/agnhost:2.55\nregistry.k8s.io/e2e-test-images/agnhost:2.66.1\n" +
		"gcr.io/authenticated-image-pulling/e2e-test-images/agnhost:2.6\ninvalid.registry.k8s.io/invalid/pause:3.10.2\n" +
		"registry.k8s.io/pause:3.10.2\nregistry.k8s.io/e2e-test-images/busybox:1.37.0-2\n"
	a, p, err := ImagesFor(list, "2.66.1")
	if err != nil {
		t.Fatal(err)
	}
	if len(a) != 1 || a[0] != "registry.k8s.io/e2e-test-images/agnhost:2.66.1" {
		t.Errorf("agnhost %v", a)
	}
	if len(p) != 1 || p[0] != "registry.k8s.io/pause:3.10.2" {
		t.Errorf("pause %v", p)
	}
	if _, _, err := ImagesFor(list, "2.70"); err == nil {
		t.Error("no error for an agnhost version the list lacks")
	}
	if g := TagsOf(list+"registry.k8s.io/e2e-test-images/glibc-dns-testing:2.1.1\n", "glibc-dns-testing"); !slices.Equal(g, []string{"registry.k8s.io/e2e-test-images/glibc-dns-testing:2.1.1"}) {
		t.Errorf("glibc-dns-testing %v", g)
	}
	if g := TagsOf(list+"registry.k8s.io/e2e-test-images/regression-issue-74839:1.5\n", "regression-issue-74839"); !slices.Equal(g, []string{"registry.k8s.io/e2e-test-images/regression-issue-74839:1.5"}) {
		t.Errorf("regression-issue-74839 %v", g)
	}
	if g := TagsOf(list, "glibc-dns-testing"); len(g) != 0 {
		t.Errorf("glibc-dns-testing %v from a list without it", g)
	}
}

func TestResolveKeepsEveryLink(t *testing.T) {
	d := t.TempDir()
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.MkdirAll(filepath.Join(d, "usr", "bin"), 0o755))
	must(os.WriteFile(filepath.Join(d, "usr", "bin", "nc.openbsd"), []byte("x"), 0o755))
	must(os.Symlink("usr/bin", filepath.Join(d, "bin")))
	must(os.MkdirAll(filepath.Join(d, "etc", "alternatives"), 0o755))
	must(os.Symlink(filepath.Join(d, "bin", "nc.openbsd"), filepath.Join(d, "etc", "alternatives", "nc")))
	must(os.Symlink(filepath.Join(d, "etc", "alternatives", "nc"), filepath.Join(d, "usr", "bin", "nc")))
	real, chain, err := resolve(filepath.Join(d, "usr", "bin", "nc"))
	if err != nil {
		t.Fatal(err)
	}
	realD, _ := filepath.EvalSymlinks(d)
	if want := filepath.Join(realD, "usr", "bin", "nc.openbsd"); real != want {
		t.Errorf("real %s, want %s", real, want)
	}
	for _, l := range []string{"usr/bin/nc", "etc/alternatives/nc", "bin"} {
		if _, ok := chain[filepath.Join(realD, l)]; !ok {
			t.Errorf("link %s missing from %v", l, chain)
		}
	}
}

// TestAgnhostImageFromThisHost builds the image with a stand-in agnhost
// and checks that the shell, curl and nc of this machine are in it with
// the links and the dynamic loader they need.
func TestAgnhostImageFromThisHost(t *testing.T) {
	for _, p := range HostTools {
		if _, err := lookPath(p); err != nil {
			t.Skipf("%v: make deps-conformance installs the tools the image takes from this machine", err)
		}
	}
	d := t.TempDir()
	src := filepath.Join(d, "src")
	porter := filepath.Join(src, "test", "images", "agnhost", "porter")
	if err := os.MkdirAll(porter, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"localhost.crt", "localhost.key"} {
		if err := os.WriteFile(filepath.Join(porter, f), []byte(f), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	bin := filepath.Join(d, "agnhost")
	if err := os.WriteFile(bin, []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(d, "img.tar")
	tag := "registry.k8s.io/e2e-test-images/agnhost:2.66.1"
	if err := AgnhostImage(ImageSpec{Agnhost: bin, KubeSrc: src, Tags: []string{tag}, Created: time.Unix(0, 0)}, out); err != nil {
		t.Fatal(err)
	}
	files, err := agnhostFiles(ImageSpec{Agnhost: bin, KubeSrc: src})
	if err != nil {
		t.Fatal(err)
	}
	have := map[string]entry{}
	for _, f := range files {
		have[f.Path] = f
	}
	for _, p := range []string{"agnhost", "agnhost-2", "localhost.crt", "etc/passwd", "usr/bin/curl", "uploads"} {
		if _, ok := have[p]; !ok {
			t.Errorf("image lacks /%s", p)
		}
	}
	// /bin/sh, /usr/bin/nc and the loader must resolve inside the image.
	for _, p := range []string{"bin/sh", "usr/bin/nc", "usr/bin/dig", "usr/bin/getent", "lib64/ld-linux-x86-64.so.2"} {
		if _, err := os.Lstat("/" + p); err != nil {
			continue // another layout or architecture
		}
		if !resolvesIn(have, p) {
			t.Errorf("/%s does not resolve to a file in the image", p)
		}
	}
}

// TestBusyBoxImage: /bin/sh and the other applets link to a busybox in
// the image.
func TestBusyBoxImage(t *testing.T) {
	if _, err := os.Stat(BusyBox); err != nil {
		t.Skipf("%v: make deps-conformance installs busybox-static", err)
	}
	files, err := busyboxFiles(BusyBox)
	if err != nil {
		t.Fatal(err)
	}
	have := map[string]entry{}
	for _, f := range files {
		have[f.Path] = f
	}
	for _, p := range []string{"bin/sh", "bin/sleep", "bin/nc", "bin/echo"} {
		if !resolvesIn(have, p) {
			t.Errorf("/%s does not resolve to a file in the image", p)
		}
	}
	if err := BusyBoxImage(BusyBox, []string{"registry.k8s.io/e2e-test-images/busybox:1.37.0-2"}, time.Unix(0, 0), filepath.Join(t.TempDir(), "img.tar")); err != nil {
		t.Fatal(err)
	}
}

// TestProgramImage: a static program's image (CoreDNS's, the Conntrack
// spec's server) runs /<name>, has it executable with the binary's content,
// and carries the tags the manifest or e2e.test name.
func TestProgramImage(t *testing.T) {
	for _, tc := range []struct{ name, tag string }{
		{"coredns", "weft-e2e/coredns:test"},
		{"regression-issue-74839", "registry.k8s.io/e2e-test-images/regression-issue-74839:1.5"},
	} {
		d := t.TempDir()
		bin := filepath.Join(d, "prog")
		if err := os.WriteFile(bin, []byte("stand-in"), 0o755); err != nil {
			t.Fatal(err)
		}
		out := filepath.Join(d, "img.tar")
		if err := ProgramImage(bin, tc.name, []string{tc.tag}, time.Unix(0, 0), out); err != nil {
			t.Fatal(err)
		}
		m, err := tarball.LoadManifest(func() (io.ReadCloser, error) { return os.Open(out) })
		if err != nil || len(m) != 1 || !slices.Equal(m[0].RepoTags, []string{tc.tag}) {
			t.Fatalf("manifest %+v, %v: want one image tagged %s", m, err, tc.tag)
		}
		img, err := tarball.ImageFromPath(out, nil)
		if err != nil {
			t.Fatal(err)
		}
		cf, err := img.ConfigFile()
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(cf.Config.Entrypoint, []string{"/" + tc.name}) {
			t.Errorf("entrypoint %q, want /%s", cf.Config.Entrypoint, tc.name)
		}
		if !layerHas(t, img, tc.name, "stand-in") {
			t.Errorf("the layer has no executable /%s with the binary's content", tc.name)
		}
	}
}

// layerHas reports whether img's one layer holds an executable file at
// path with data.
func layerHas(t *testing.T, img v1.Image, path, data string) bool {
	t.Helper()
	layers, err := img.Layers()
	if err != nil || len(layers) != 1 {
		t.Fatalf("layers %d, %v: want 1", len(layers), err)
	}
	rc, err := layers[0].Uncompressed()
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	tr := tar.NewReader(rc)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return false
		}
		if err != nil {
			t.Fatal(err)
		}
		if h.Name == path && h.Mode&0o111 != 0 {
			got, err := io.ReadAll(tr)
			return err == nil && string(got) == data
		}
	}
}

// TestGlibcDNSImageFromThisHost: the DNS specs' glibc querier has /coredns
// and a dig, getent and sh that resolve, with their loader, in the image.
func TestGlibcDNSImageFromThisHost(t *testing.T) {
	for _, p := range DNSTestingTools {
		if _, err := lookPath(p); err != nil {
			t.Skipf("%v: make deps-conformance installs the tools the image takes from this machine", err)
		}
	}
	d := t.TempDir()
	bin := filepath.Join(d, "coredns")
	if err := os.WriteFile(bin, []byte("stand-in"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := GlibcDNSImage(bin, []string{"registry.k8s.io/e2e-test-images/glibc-dns-testing:2.1.1"}, time.Unix(0, 0), filepath.Join(d, "img.tar")); err != nil {
		t.Fatal(err)
	}
	files, err := glibcDNSFiles(bin)
	if err != nil {
		t.Fatal(err)
	}
	have := map[string]entry{}
	for _, f := range files {
		have[f.Path] = f
	}
	if f, ok := have["coredns"]; !ok || string(f.Data) != "stand-in" {
		t.Error("image lacks /coredns")
	}
	for _, p := range []string{"bin/sh", "usr/bin/dig", "usr/bin/getent", "usr/bin/seq", "lib64/ld-linux-x86-64.so.2"} {
		if _, err := os.Lstat("/" + p); err != nil {
			continue // another layout or architecture
		}
		if !resolvesIn(have, p) {
			t.Errorf("/%s does not resolve to a file in the image", p)
		}
	}
}

// resolvesIn follows links within the image's files.
func resolvesIn(files map[string]entry, p string) bool {
	for hops := 0; hops < 40; hops++ {
		parts := strings.Split(p, "/")
		moved := false
		for i := 1; i <= len(parts); i++ {
			pre := strings.Join(parts[:i], "/")
			f, ok := files[pre]
			if !ok || f.Mode&os.ModeSymlink == 0 {
				continue
			}
			target := f.Link
			if !filepath.IsAbs(target) {
				target = filepath.Join(filepath.Dir("/"+pre), target)
			}
			p = strings.TrimPrefix(filepath.Join(append([]string{target}, parts[i:]...)...), "/")
			moved = true
			break
		}
		if !moved {
			f, ok := files[p]
			return ok && f.Mode.IsRegular()
		}
	}
	return false
}
