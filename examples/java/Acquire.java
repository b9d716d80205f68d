// Acquire a lock, waiting for it if another worker holds it; print the
// fencing token; release it. A second acquire while we hold the lock shows
// how an error answer ({"error": code, "message": text}) looks.
// Run: java Acquire.java   (JDK 17+, no dependencies)
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpRequest.BodyPublishers;
import java.net.http.HttpResponse.BodyHandlers;
import java.util.regex.Matcher;
import java.util.regex.Pattern;

public class Acquire {
    static final String API = System.getenv().getOrDefault("FENCER_API", "http://127.0.0.1:7411");
    static final String KEY = "example:acquire";
    static final HttpClient HTTP = HttpClient.newBuilder().version(HttpClient.Version.HTTP_1_1).build();

    /** An error answer of fencer: {"error": code, "message": text}. */
    static class FencerException extends RuntimeException {
        final String code;

        FencerException(int status, String body) {
            super(status + " " + field(body, "error") + ": " + field(body, "message"));
            code = field(body, "error");
        }
    }

    static String call(String method, String url, String json) throws Exception {
        var req = HttpRequest.newBuilder(URI.create(url))
                .header("Content-Type", "application/json")
                .method(method, json == null ? BodyPublishers.noBody() : BodyPublishers.ofString(json))
                .build();
        var res = HTTP.send(req, BodyHandlers.ofString());
        if (res.statusCode() != 200) throw new FencerException(res.statusCode(), res.body());
        return res.body();
    }

    /** The first string or number field so named; use your JSON library in real code. */
    static String field(String json, String name) {
        Matcher m = Pattern.compile("\"" + name + "\"\\s*:\\s*(?:\"([^\"]*)\"|([^,}\\s]+))").matcher(json);
        return !m.find() ? null : m.group(1) != null ? m.group(1) : m.group(2);
    }

    public static void main(String[] args) throws Exception {
        try {
            // Wait up to 5 s in the key's FIFO queue if someone else holds it.
            String lease = call("POST", API + "/v1/locks/" + KEY + "/acquire", "{\"ttl_ms\": 10000, \"wait_ms\": 5000}");
            System.out.println("acquired token=" + field(lease, "token"));
            try {
                // ... do the work the lock protects ...
                try { // another worker would wait 200 ms, then get 409 lock_held
                    call("POST", API + "/v1/locks/" + KEY + "/acquire", "{\"wait_ms\": 200}");
                } catch (FencerException e) {
                    System.out.println("second acquire refused: " + e.code);
                }
            } finally {
                call("POST", API + "/v1/locks/" + KEY + "/release", "{\"lease_id\": \"" + field(lease, "lease_id") + "\"}");
                System.out.println("released");
            }
        } catch (FencerException e) {
            System.err.println("error: " + e.getMessage());
            System.exit(1);
        } catch (java.io.IOException e) {
            System.err.println("error: cannot reach fencer: " + e);
            System.exit(1);
        }
    }
}
